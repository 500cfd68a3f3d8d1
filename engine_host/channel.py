"""The control channel between the API-server process and the engine-core process.

vLLM runs its scheduler in the engine-core process, apart from the HTTP server. The
two share one memory-mapped file (``$SPECPILOT_HOME/run/engine-<port>.chan``, made
afresh at each engine start, so a stale engine core that still maps an old file never
shares it with a new engine) with two regions, each with a single writer and a
sequence lock:

* config region, written by the API process: ``{"version": n, "config": LiveConfig}``,
  and its acknowledgement word, written by the engine core: the config sequence number
  of the last command it took a decision on and the decision (applied or refused);
* state region, written by the engine core: controller state, K in force, the last
  config version it applied, counters (a JSON object).

Reading the config sequence number costs one ``struct.unpack_from`` per engine step,
so the scheduler hook notices a new config within one step at no measurable cost.

A config command is decided under an exclusive ``flock`` of the file: the engine core
takes it (without blocking) to read and apply a new config and to write the
acknowledgement; the API process takes it to publish a config, and, when it gives up
waiting, to withdraw the command (republish the previous version). So a command the API
answered as not applied (HTTP 503) can never be applied later, and one the core applied
is never answered as failed.

Layout (little endian)::

    0      8 bytes  magic b"SPCHAN02"
    8      u64      config seq (odd while being written)
    16     u32      config length
    20     u32      ack outcome (0 none, 1 applied, 2 refused), engine core
    24     u64      ack: the config seq that outcome answers, engine core
    32..   config JSON (up to CONFIG_BYTES)
    STATE_OFF      u64 state seq, u32 length, state JSON (up to STATE_BYTES)

The file is sparse: only the bytes written take memory or disk.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

from . import envs

MAGIC = b"SPCHAN02"
CONFIG_OFF = 8
ACK_OFF = 20
CONFIG_DATA_OFF = 32
CONFIG_BYTES = 4 * 1024 * 1024
STATE_OFF = CONFIG_DATA_OFF + CONFIG_BYTES
STATE_BYTES = 8 * 1024 * 1024
FILE_SIZE = STATE_OFF + 12 + STATE_BYTES
ENV_CHANNEL = envs.CHANNEL

ACK_NONE, ACK_APPLIED, ACK_REFUSED = 0, 1, 2

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_ACK = struct.Struct("<IQ")


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
            # a new file (new inode) replaces any old one: an engine core left from an
            # earlier start keeps its own mapping and never sees this engine's commands
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, MAGIC)
                os.ftruncate(fd, FILE_SIZE)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        if not self.path.is_file():
            raise ChannelError(f"control channel {self.path} does not exist")
        self._fd = os.open(self.path, os.O_RDWR)
        if os.fstat(self._fd).st_size < FILE_SIZE:
            os.close(self._fd)
            raise ChannelError(f"{self.path} is not a SpecPilot control channel of this version")
        self._mm = mmap.mmap(self._fd, FILE_SIZE)
        self._views: list[memoryview] = []
        if self._mm[:8] != MAGIC:
            self.close()
            raise ChannelError(f"{self.path} is not a SpecPilot control channel")

    def inode(self) -> int:
        """Inode of the mapped file (a fresh one per engine start)."""
        return os.fstat(self._fd).st_ino

    # -- the command lock ----------------------------------------------------
    def try_lock(self) -> bool:
        """Take the command lock without blocking; True when taken."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        """Release the command lock."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def write_ack(self, seq: int, outcome: int) -> None:
        """Engine core, holding the lock: record its decision (:data:`ACK_APPLIED` or
        :data:`ACK_REFUSED`) on the command published with config sequence number ``seq``."""
        _ACK.pack_into(self._mm, ACK_OFF, outcome, seq)

    def read_ack(self) -> tuple[int, int]:
        """``(seq, outcome)`` of the engine core's last decision (one read, no lock)."""
        outcome, seq = _ACK.unpack_from(self._mm, ACK_OFF)
        return seq, outcome

    # -- low level seqlock -------------------------------------------------
    def _write(self, off: int, data_off: int, limit: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        if len(data) > limit:
            raise ChannelError(f"payload of {len(data)} bytes does not fit in {limit}")
        seq = _U64.unpack_from(self._mm, off)[0]
        _U64.pack_into(self._mm, off, seq + 1)  # odd: writing
        _U32.pack_into(self._mm, off + 8, len(data))
        self._mm[data_off : data_off + len(data)] = data
        _U64.pack_into(self._mm, off, seq + 2)

    def _read(self, off: int, data_off: int, limit: int) -> tuple[int, dict[str, Any] | None]:
        for _ in range(1000):
            s1 = _U64.unpack_from(self._mm, off)[0]
            if s1 & 1:
                time.sleep(0)
                continue
            n = _U32.unpack_from(self._mm, off + 8)[0]
            data = bytes(self._mm[data_off : data_off + min(n, limit)])
            if _U64.unpack_from(self._mm, off)[0] == s1:
                if s1 == 0 or n == 0:
                    return s1, None
                return s1, json.loads(data)
        raise ChannelError("channel region kept changing while being read")

    # -- config: API process writes, engine core reads ---------------------
    def config_seq(self) -> int:
        """Sequence number of the config region (cheap; read each engine step)."""
        return _U64.unpack_from(self._mm, CONFIG_OFF)[0]

    def config_seq_view(self) -> memoryview | None:
        """The config region's sequence number as a one-element view (``view[0]``, the same
        number as :meth:`config_seq`): the engine core reads it every step, and indexing a
        view costs a fraction of a method call and a ``struct`` unpack when the CPU's caches
        are cold. None on a big-endian machine (the file is little-endian; use
        :meth:`config_seq`). Released by :meth:`close`."""
        if sys.byteorder != "little":
            return None
        view = memoryview(self._mm)[CONFIG_OFF : CONFIG_OFF + 8].cast("Q")
        self._views.append(view)
        return view

    def write_config(
        self, version: int, config: dict[str, Any], warmup_k: int | None = None, withdrawn: int | None = None
    ) -> None:
        """Publish config ``version`` (a ``LiveConfig`` dump) to the engine core.

        ``warmup_k`` (tokens), when set, makes the engine core use that K for every
        step regardless of the policy: the start-up warm-up uses it to cover each depth.
        ``withdrawn``: the version this write takes back (the API gave up on it).
        The API process calls it holding the command lock (:meth:`try_lock`).

        Raises:
            ChannelError: the config does not fit (:data:`CONFIG_BYTES`).
        """
        payload = {"version": version, "config": config, "warmup_k": warmup_k, "written_at": time.time()}
        if withdrawn is not None:
            payload["withdrawn"] = withdrawn
        self._write(CONFIG_OFF, CONFIG_DATA_OFF, CONFIG_BYTES, payload)

    def read_config(self) -> tuple[int, dict[str, Any] | None]:
        """Return ``(seq, {"version", "config", "warmup_k", "written_at"} or None)``."""
        return self._read(CONFIG_OFF, CONFIG_DATA_OFF, CONFIG_BYTES)

    # -- state: engine core writes, API process reads ----------------------
    def write_state(self, state: dict[str, Any]) -> None:
        """Publish the engine core's state (controller, K, applied version)."""
        self._write(STATE_OFF, STATE_OFF + 12, STATE_BYTES, state)

    def read_state(self) -> dict[str, Any] | None:
        """Return the last state published by the engine core, or None before the first."""
        return self._read(STATE_OFF, STATE_OFF + 12, STATE_BYTES)[1]

    def close(self) -> None:
        """Unmap the file (views from :meth:`config_seq_view` are released first)."""
        try:
            for view in self._views:
                view.release()
            self._views.clear()
            self._mm.close()
        finally:
            os.close(self._fd)


def channel_from_env() -> Channel | None:
    """Open the channel named by ``$SPECPILOT_CHANNEL``; None when unset."""
    path = envs.channel_path()
    return Channel(path) if path else None
