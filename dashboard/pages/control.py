"""Control: change a host's speculation policy, batch caps and warm-up schedules.

Each form is validated with the engine's own config model (errors inline, under the
field), needs a reason, shows the diff against the config in force, asks for a
confirmation, then shows the engine's answer. Viewers see the config read-only.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import streamlit as st

from control.views import common
from control.views import control as views
from dashboard import ui
from engine_host.config import SPECULATION_MODES, BatchConfig, HeartbeatSchedule, SpeculationConfig

user = ui.require_user()
ui.page_header(
    "Control",
    "Change live settings: validated against the engine's limits, recorded with your name "
    "and reason, applied within one engine step.",
)
host = ui.host_picker()

ERRORS = "ctl_errors"
PENDING = "ctl_pending"
OUTCOME = "ctl_outcome"


@st.cache_data(ttl=2, show_spinner=False)
def _status(name: str) -> common.HostStatus:
    return common.host_status(ui.store(), name)


def _help(model: Any, name: str) -> str | None:
    field = model.model_fields.get(name)
    return field.description if field else None


def _errors(section: str) -> dict[str, str]:
    errs = st.session_state.get(ERRORS) or {}
    return errs.get(section, {}) if errs.get("host") == host else {}


def _inline(section: str, *fields: str) -> None:
    """Show the errors of ``fields`` right under the widget."""
    errs = _errors(section)
    for f in fields:
        if f in errs:
            st.error(errs[f], icon=":material/error:")


def _inline_heartbeat(field: str) -> None:
    """Errors of a heartbeat field (``warmup.heartbeats.<i>.<field>``), under its widget."""
    for key, msg in _errors("warmup").items():
        parts = key.split(".")
        if len(parts) >= 4 and parts[:2] == ["warmup", "heartbeats"] and parts[3] == field:
            st.error(msg, icon=":material/error:")


def _general(section: str, shown: set[str]) -> None:
    """Errors not tied to a field shown in the form (e.g. k_min above k_max)."""
    for key, msg in _errors(section).items():
        if key not in shown:
            label = "" if key in ("config", "") else f"`{key}`: "
            st.error(f"{label}{msg}", icon=":material/error:")


def _int_input(
    label: str, value: int | None, key: str, help: str | None = None, placeholder: str | None = None
) -> int | None:
    return st.number_input(label, value=value, step=1, format="%d", key=key, help=help, placeholder=placeholder)


def _submit(
    section: str, patch: dict[str, Any] | None, reason: str, parse_errors: dict[str, str], status: common.HostStatus
) -> None:
    """Validate; on errors keep them for inline display, else keep the change for review."""
    errors = dict(parse_errors)
    try:
        common.require_reason(reason)
    except common.ViewError as exc:
        errors["reason"] = str(exc)
    preview = None
    if patch is not None:
        preview = views.preview_change(status.config, status.limits, patch)
        errors.update(preview.errors)
    st.session_state.pop(OUTCOME, None)
    if errors:
        st.session_state[ERRORS] = {"host": host, section: errors}
        st.session_state.pop(PENDING, None)
    else:
        st.session_state.pop(ERRORS, None)
        st.session_state[PENDING] = {
            "host": host,
            "section": section,
            "patch": patch,
            "reason": reason.strip(),
            "diff": preview.diff,
            "base_version": status.config_version,
        }
    st.rerun()


def _review(status: common.HostStatus) -> None:
    pending = st.session_state.get(PENDING)
    if not pending or pending["host"] != host:
        return
    with st.container(border=True):
        st.subheader(f"Review the change to {host}")
        ui.dataframe(
            pd.DataFrame(
                [
                    {"setting": d["field"], "now": json.dumps(d["old"]), "after": json.dumps(d["new"])}
                    for d in pending["diff"]
                ]
            ),
            hide_index=True,
            width="stretch",
        )
        st.markdown(f"**Reason:** {pending['reason']}  \n**Author:** {user.name}")
        if status.config_version != pending["base_version"]:
            st.warning(
                f"The config in force changed since this preview (v{pending['base_version']} → "
                f"v{status.config_version}): cancel and preview again."
            )
        c1, c2, _ = st.columns([1, 1, 4])
        if c1.button(
            f"Apply to {host}",
            type="primary",
            key="confirm_apply",
            disabled=status.config_version != pending["base_version"],
        ):
            with st.spinner("Applying…"):
                try:
                    outcome = views.apply_change(ui.store(), host, pending["patch"], user, pending["reason"])
                except common.ViewError as exc:
                    outcome = views.ChangeOutcome(applied=False, version=None, message=str(exc))
                except Exception as exc:
                    outcome = views.ChangeOutcome(applied=False, version=None, message=common.describe_error(exc))
            st.session_state[OUTCOME] = {"host": host, "outcome": outcome}
            st.session_state.pop(PENDING, None)
            _status.clear()
            st.rerun()
        if c2.button("Cancel", key="cancel_apply"):
            st.session_state.pop(PENDING, None)
            st.rerun()


def _outcome() -> None:
    last = st.session_state.get(OUTCOME)
    if not last or last["host"] != host:
        return
    o: views.ChangeOutcome = last["outcome"]
    if o.applied:
        k = f" K in force: {o.k_in_force}." if o.k_in_force is not None else ""
        st.success(
            f"Applied: version {o.version} is in force on {host}.{k} {o.message}".strip(),
            icon=":material/check_circle:",
        )
    else:
        rec = f" Recorded as failed (version {o.version})." if o.version is not None else ""
        st.error(f"Not applied: {o.message}.{rec} The engine stays on its last good config.", icon=":material/cancel:")


def _speculation_form(status: common.HostStatus) -> None:
    spec = status.config.get("speculation") or {}
    section = "speculation"
    shown = {
        "speculation.mode",
        "speculation.k",
        "speculation.k_min",
        "speculation.k_max",
        "speculation.table",
        "reason",
    }
    with st.form("speculation_form"):
        _general(section, shown)
        c = st.columns(4)
        with c[0]:
            mode = st.selectbox(
                "Mode",
                SPECULATION_MODES,
                index=SPECULATION_MODES.index(spec.get("mode", "fixed")),
                key="f_mode",
                help="off: K=0 · fixed: static K · adaptive: goodput controller in "
                "K_min..K_max · batch_table, threshold, heuristic: the baselines",
            )
            _inline(section, "speculation.mode")
        with c[1]:
            k = _int_input("K (fixed mode)", spec.get("k", 0), "f_k", _help(SpeculationConfig, "k"))
            _inline(section, "speculation.k")
        with c[2]:
            k_min = _int_input("K min", spec.get("k_min", 0), "f_k_min", _help(SpeculationConfig, "k_min"))
            _inline(section, "speculation.k_min")
        with c[3]:
            k_max = _int_input(
                "K max",
                spec.get("k_max"),
                "f_k_max",
                _help(SpeculationConfig, "k_max"),
                placeholder=f"engine K_max ({status.k_max_engine})",
            )
            _inline(section, "speculation.k_max")
        table_now = spec.get("table") or []
        table_text = st.text_input(
            "Batch table (mode batch_table)",
            ", ".join(f"{a}-{b}={kk}" for a, b, kk in table_now),
            key="f_table",
            help="batch-size ranges and K, e.g. 1-2=6, 3-8=4, 9-1024=2",
        )
        _inline(section, "speculation.table")
        reason = st.text_input("Reason (required)", key="f_reason_spec", placeholder="why: ticket, incident, test…")
        _inline(section, "reason")
        submitted = st.form_submit_button("Preview change", type="primary")
    if submitted:
        parse_errors: dict[str, str] = {}
        patch_spec: dict[str, Any] = {"mode": mode, "k": k, "k_min": k_min, "k_max": k_max}
        for name, v in (("k", k), ("k_min", k_min)):
            if v is None:
                parse_errors[f"speculation.{name}"] = "a number is required"
        if mode == "batch_table":
            try:
                patch_spec["table"] = _parse_table(table_text)
            except ValueError as exc:
                parse_errors["speculation.table"] = str(exc)
        _submit(section, {"speculation": patch_spec}, reason, parse_errors, status)


def _parse_table(text: str) -> list[list[int]]:
    out = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        try:
            rng, kk = part.split("=")
            lo, hi = rng.split("-")
            out.append([int(lo), int(hi), int(kk)])
        except ValueError:
            raise ValueError(f"{part!r}: write each entry as START-END=K, e.g. 1-2=6") from None
    return out


def _batch_form(status: common.HostStatus) -> None:
    batch = status.config.get("batch") or {}
    limits = status.limits
    section = "batch"
    with st.form("batch_form"):
        _general(section, {"batch.max_num_seqs", "batch.max_num_batched_tokens", "reason"})
        c = st.columns(2)
        with c[0]:
            seqs = _int_input(
                "Max running sequences (max_num_seqs)",
                batch.get("max_num_seqs"),
                "f_seqs",
                f"{_help(BatchConfig, 'max_num_seqs')}; empty = start-up value "
                f"({limits.get('max_num_seqs')}), which is also the ceiling",
                placeholder=f"start-up value ({limits.get('max_num_seqs')})",
            )
            _inline(section, "batch.max_num_seqs")
        with c[1]:
            tokens = _int_input(
                "Max tokens per step (max_num_batched_tokens)",
                batch.get("max_num_batched_tokens"),
                "f_tokens",
                f"{_help(BatchConfig, 'max_num_batched_tokens')}; empty = start-up value "
                f"({limits.get('max_num_batched_tokens')})",
                placeholder=f"start-up value ({limits.get('max_num_batched_tokens')})",
            )
            _inline(section, "batch.max_num_batched_tokens")
        reason = st.text_input("Reason (required)", key="f_reason_batch")
        _inline(section, "reason")
        submitted = st.form_submit_button("Preview change", type="primary")
    if submitted:
        _submit(section, {"batch": {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}}, reason, {}, status)


def _warmup_form(status: common.HostStatus) -> None:
    beats = list((status.config.get("warmup") or {}).get("heartbeats") or [])
    section = "warmup"
    if beats:
        ui.dataframe(
            pd.DataFrame(
                [
                    {
                        "name": b["name"],
                        "every (s)": b.get("interval_s"),
                        "cron (UTC)": b.get("cron"),
                        "max tokens": b.get("max_tokens"),
                        "only after idle (s)": b.get("idle_s"),
                        "enabled": b.get("enabled"),
                    }
                    for b in beats
                ]
            ).pipe(ui.no_none),
            hide_index=True,
            width="stretch",
        )
    else:
        st.caption("No heartbeat schedule in force.")
    fields = ("name", "interval_s", "cron", "max_tokens", "idle_s", "prompts")
    with st.form("warmup_form"):
        field_keys = {k for k in _errors(section) if len(k.split(".")) >= 4 and k.split(".")[3] in fields}
        _general(section, field_keys | {"reason"})
        action = st.radio("Action", ["add or replace", "remove"], horizontal=True, key="f_hb_action")
        c = st.columns(3)
        with c[0]:
            name = st.text_input("Name", key="f_hb_name", help="letters, digits, _ . - (replaces one of that name)")
            _inline_heartbeat("name")
        with c[1]:
            interval = st.number_input(
                "Every (s)",
                value=None,
                key="f_hb_interval",
                help=_help(HeartbeatSchedule, "interval_s") + "; set this or cron",
            )
            _inline_heartbeat("interval_s")
        with c[2]:
            cron = st.text_input("Cron (UTC)", key="f_hb_cron", help=_help(HeartbeatSchedule, "cron"))
            _inline_heartbeat("cron")
        c = st.columns(3)
        with c[0]:
            max_tokens = _int_input("Max tokens", 8, "f_hb_max_tokens", _help(HeartbeatSchedule, "max_tokens"))
            _inline_heartbeat("max_tokens")
        with c[1]:
            idle = st.number_input(
                "Only after idle (s)", value=30.0, key="f_hb_idle", help=_help(HeartbeatSchedule, "idle_s")
            )
            _inline_heartbeat("idle_s")
        with c[2]:
            enabled = st.checkbox("Enabled", value=True, key="f_hb_enabled")
        prompt = st.text_input("Prompt", "Hello! Please reply with a short greeting.", key="f_hb_prompt")
        _inline_heartbeat("prompts")
        reason = st.text_input("Reason (required)", key="f_reason_warmup")
        _inline(section, "reason")
        submitted = st.form_submit_button("Preview change", type="primary")
    if submitted:
        errors: dict[str, str] = {}
        others = [b for b in beats if b["name"] != name.strip()]
        if action == "remove":
            if len(others) == len(beats):
                errors["remove"] = f"no heartbeat named {name!r} to remove"
            new = others
        else:
            new = others + [
                {
                    "name": name.strip(),
                    "interval_s": interval,
                    "cron": cron.strip() or None,
                    "prompts": [prompt],
                    "max_tokens": max_tokens,
                    "idle_s": idle,
                    "enabled": enabled,
                }
            ]
        _submit(section, {"warmup": {"heartbeats": new}}, reason, errors, status)


def _read_only(status: common.HostStatus) -> None:
    st.info(
        f"You are signed in as **{user.name}** ({user.role}): read only. Operators can change settings.",
        icon=":material/visibility:",
    )


status = _status(host)
_outcome()
if not status.up:
    st.error(f"{host} is DOWN ({status.error}): settings cannot be changed until it answers.", icon=":material/error:")
    st.stop()

spec = status.config.get("speculation") or {}
cols = st.columns(4)
cols[0].metric("Mode", status.mode or "—")
cols[1].metric(
    "K in force",
    ui.fmt(status.k_next),
    help=f"draft tokens the policy uses for the next step; the last step ran K={ui.fmt(status.k_current)}",
)
cols[2].metric("Max running", f"{ui.fmt(status.max_num_seqs)}", help="cap in force (requests)")
in_force = common.version_in_force(ui.store(), host)
cols[3].metric(
    "Config version",
    "—" if in_force is None else f"v{in_force}",
    help=f"the control plane's version in force (History); the engine's own counter says "
    f"v{status.config_version} (it restarts at 1 with the engine)",
)

if not user.can("apply"):
    _read_only(status)
    with st.expander("Config in force", expanded=True):
        st.json(status.config)
    st.stop()

_review(status)
tab_spec, tab_batch, tab_warm = st.tabs(["Speculation", "Batch caps", "Warm-up schedules"], key="ctl_tabs")
with tab_spec:
    _speculation_form(status)
with tab_batch:
    _batch_form(status)
with tab_warm:
    _warmup_form(status)
with st.expander("Config in force (JSON)"):
    st.json(status.config)
