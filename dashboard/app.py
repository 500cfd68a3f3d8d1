"""SpecPilot dashboard: the entry file (``streamlit run dashboard/app.py``, or
``python -m dashboard``).

A router: the login page until someone logs in, then the pages (one file each in
``pages/``) with the signed-in user and a log-out button in the sidebar. Viewers see
every page read-only; operators may also apply and roll back.

A session survives a reload through a signed cookie (:mod:`dashboard.session`). Before
login every page's address leads to the login form, so a deep link (``/history``)
opens its page once the user has logged in.
"""

from __future__ import annotations

import streamlit as st

st.set_page_config(
    page_title="SpecPilot", page_icon=":material/speed:", layout="wide", initial_sidebar_state="expanded"
)

from control.views import common  # noqa: E402
from dashboard import session, ui  # noqa: E402

#: Pages by address (``url_path``); the first is the default.
PAGES = [
    ("pages/live.py", "Live", ":material/monitoring:"),
    ("pages/control.py", "Control", ":material/tune:"),
    ("pages/history.py", "History", ":material/history:"),
    ("pages/fleet.py", "Fleet", ":material/dns:"),
    ("pages/alerts.py", "Alerts", ":material/notifications:"),
    ("pages/cost.py", "Cost review", ":material/payments:"),
    ("pages/planner.py", "Planner", ":material/query_stats:"),
]


def login_page() -> None:
    """User name and password; on success the pages appear."""
    st.title("SpecPilot")
    st.caption("Operations dashboard for vLLM serving with adaptive speculative decoding")
    try:
        users = common.load_users()
    except common.AuthError as exc:
        st.error(f"The users file cannot be read: {exc}")
        st.stop()
    if not users:
        st.warning(
            "No dashboard user is configured. Add one on the server with "
            "`python -m dashboard users add NAME --role operator`."
        )
        st.stop()
    with st.form("login", clear_on_submit=False, width=420):
        name = st.text_input("User name", key="login_name", autocomplete="username")
        password = st.text_input("Password", type="password", key="login_password", autocomplete="current-password")
        submitted = st.form_submit_button("Log in", type="primary")
    if submitted:
        try:
            user = common.login(ui.store(), name, password, users)
        except common.AuthError as exc:
            st.error(str(exc))
        else:
            st.session_state["user"] = user
            st.session_state["session_token"] = session.issue(user)
            st.session_state.pop("login_password", None)
            st.session_state.pop("logged_out", None)
            st.rerun()
    if st.session_state.get("logged_out"):
        st.html(session.clear_cookie_script(), unsafe_allow_javascript=True)


def _logout() -> None:
    for key in list(st.session_state.keys()):
        del st.session_state[key]
    st.session_state["logged_out"] = True  # the cookie this session started with no longer counts


def _url_path(script: str) -> str:
    return script.rsplit("/", 1)[-1].removesuffix(".py")


user = ui.current_user()
if user is None and not st.session_state.get("logged_out"):
    user = session.restore(st.context.cookies.get(session.COOKIE))  # a reload, a new tab, a deep link
    if user is not None:
        st.session_state["user"] = user
if user is None:
    # Every page's address shows the login form, so that a deep link opens its page after login.
    page = st.navigation(
        [
            st.Page(login_page, title="Log in", icon=":material/login:", url_path=_url_path(f), default=i == 0)
            for i, (f, _, _) in enumerate(PAGES)
        ],
        position="hidden",
    )
else:
    pages = [st.Page(f, title=title, icon=icon, default=i == 0) for i, (f, title, icon) in enumerate(PAGES)]
    page = st.navigation(pages, position="sidebar", expanded=True)
    with st.sidebar:
        if st.session_state.get("session_token"):
            st.html(session.set_cookie_script(st.session_state["session_token"]), unsafe_allow_javascript=True)
        st.markdown(f"Signed in as **{user.name}** · {user.role}")
        if user.role == "viewer":
            st.caption("Read only: viewers cannot change configs.")
        st.button("Log out", on_click=_logout, icon=":material/logout:")
page.run()
