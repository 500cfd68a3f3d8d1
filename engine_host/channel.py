"""The control channel between the API-server process and the engine-core process.

vLLM runs its scheduler in the engine-core process, apart from the HTTP server. The
two share one small memory-mapped file (``$SPECPILOT_HOME/run/engine-<port>.chan``)
with two regions, each with a single writer and a sequence lock:

* config region, written by the API process: ``{"version": n, "config": LiveConfig}``;
* state region, written by the engine core: controller state, K in force, the last
  config version it applied, counters (a JSON object).

Reading the config sequence number costs one ``struct.unpack_from`` per engine step,
so the scheduler hook notices a new config within one step at no measurable cost.

Layout (little endian)::

    0      8 bytes  magic b"SPCHAN01"
    8      u64      config seq (odd while being written)
    16     u32      config length
    20..   config JSON (up to CONFIG_BYTES)
    STATE_OFF      u64 state seq, u32 length, state JSON (up to STATE_BYTES)
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

from . import envs

MAGIC = b"SPCHAN01"
CONFIG_OFF = 8
CONFIG_BYTES = 16 * 1024
STATE_OFF = 32 * 1024
STATE_BYTES = 96 * 1024
FILE_SIZE = STATE_OFF + 12 + STATE_BYTES
ENV_CHANNEL = envs.CHANNEL

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class ChannelError(RuntimeError):
    """The channel file is missing, corrupt, or a payload does not fit."""


class Channel:
    """One memory-mapped control channel.

    Args:
        path: the channel file.
        create: create (or reset) the file; done once by the launcher before the
            engine starts.
    Raises:
        ChannelError: the file does not exist or is not a channel.
    """

    def __init__(self, path: str | os.PathLike[str], create: bool = False):
        self.path = Path(path)
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(MAGIC + b"\0" * (FILE_SIZE - len(MAGIC)))
            os.chmod(self.path, 0o600)
        if not self.path.is_file():
            raise ChannelError(f"control channel {self.path} does not exist")
        self._fd = os.open(self.path, os.O_RDWR)
        self._mm = mmap.mmap(self._fd, FILE_SIZE)
        if self._mm[:8] != MAGIC:
            raise ChannelError(f"{self.path} is not a SpecPilot control channel")

    # -- low level seqlock -------------------------------------------------
    def _write(self, off: int, limit: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode()
        if len(data) > limit:
            raise ChannelError(f"payload of {len(data)} bytes does not fit in {limit}")
        seq = _U64.unpack_from(self._mm, off)[0]
        _U64.pack_into(self._mm, off, seq + 1)  # odd: writing
        _U32.pack_into(self._mm, off + 8, len(data))
        self._mm[off + 12 : off + 12 + len(data)] = data
        _U64.pack_into(self._mm, off, seq + 2)

    def _read(self, off: int, limit: int) -> tuple[int, dict[str, Any] | None]:
        for _ in range(1000):
            s1 = _U64.unpack_from(self._mm, off)[0]
            if s1 & 1:
                time.sleep(0)
                continue
            n = _U32.unpack_from(self._mm, off + 8)[0]
            data = bytes(self._mm[off + 12 : off + 12 + min(n, limit)])
            if _U64.unpack_from(self._mm, off)[0] == s1:
                if s1 == 0 or n == 0:
                    return s1, None
                return s1, json.loads(data)
        raise ChannelError("channel region kept changing while being read")

    # -- config: API process writes, engine core reads ---------------------
    def config_seq(self) -> int:
        """Sequence number of the config region (cheap; read each engine step)."""
        return _U64.unpack_from(self._mm, CONFIG_OFF)[0]

    def write_config(self, version: int, config: dict[str, Any], warmup_k: int | None = None) -> None:
        """Publish config ``version`` (a ``LiveConfig`` dump) to the engine core.

        ``warmup_k`` (tokens), when set, makes the engine core use that K for every
        step regardless of the policy: the start-up warm-up uses it to cover each depth.
        """
        self._write(
            CONFIG_OFF,
            CONFIG_BYTES,
            {"version": version, "config": config, "warmup_k": warmup_k, "written_at": time.time()},
        )

    def read_config(self) -> tuple[int, dict[str, Any] | None]:
        """Return ``(seq, {"version", "config", "written_at"} or None)``."""
        return self._read(CONFIG_OFF, CONFIG_BYTES)

    # -- state: engine core writes, API process reads ----------------------
    def write_state(self, state: dict[str, Any]) -> None:
        """Publish the engine core's state (controller, K, applied version)."""
        self._write(STATE_OFF, STATE_BYTES, state)

    def read_state(self) -> dict[str, Any] | None:
        """Return the last state published by the engine core, or None before the first."""
        return self._read(STATE_OFF, STATE_BYTES)[1]

    def close(self) -> None:
        """Unmap the file."""
        try:
            self._mm.close()
        finally:
            os.close(self._fd)


def channel_from_env() -> Channel | None:
    """Open the channel named by ``$SPECPILOT_CHANNEL``; None when unset."""
    path = envs.channel_path()
    return Channel(path) if path else None
