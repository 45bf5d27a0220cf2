"""One model served by several processes, one per host (`kinetic serve MODEL --coordinator
HOST:PORT --num-processes P --process-id I`): jax.distributed joins them, and the devices of
all of them form the split's mesh (engine/split.py), each process holding its devices' part
of the weights.

Process 0, the leader, serves HTTP and schedules as a server of one process does. Every
Runner call that runs a program over the mesh is a `mirrored` one: before it runs, the
leader sends the call's name and host arguments to the others with JAX's own broadcast
(multihost_utils.broadcast_one_to_all, a sum over every process's devices), and each
follower (which serves nothing: `follow`) makes the same call on its own Runner. So every
process runs the same programs in the same order, as multi-process JAX requires, and each
gets the same bits. The message is Python's pickle of host values: the processes of one
model trust each other as jax.distributed does, and nothing outside them writes to it.

Nothing hangs when a process stops:
- a collective with a process that has stopped fails at once (its connections close), so
  the leader's step raises, the engine fails the requests it runs, and the leader exits
  (`Leader.lost`) after a grace for their error events to leave;
- a stopped process (or a frozen one) stops sending the coordination service heartbeats,
  and after HEARTBEAT_SECONDS JAX ends every other process itself;
- a follower whose leader has stopped fails in its broadcast and exits.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import numpy as np

HEARTBEAT_SECONDS = 10   # a process silent this long ends the others (jax.distributed)
READY_SECONDS = 1800     # how long processes wait for each other's model to load
GRACE_SECONDS = 2.0      # the leader's error events leave before it exits
FIRST = 1 << 16          # bytes of a call's first broadcast (most fit; the rest follows)

_joined = False


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the processes (jax.distributed.initialize): before JAX starts its backend."""
    global _joined
    import jax
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=READY_SECONDS,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)
    _joined = True


def joined() -> bool:
    """Whether this process is one of several (initialize)."""
    return _joined


def is_leader() -> bool:
    import jax
    return jax.process_index() == 0


def wait_for_all(name: str) -> None:
    """Until every process reaches the same point (their models loaded): the first
    broadcast would give up after 30 s on a process still loading."""
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier(f"kinetic-{name}", READY_SECONDS * 1000)


class Leader:
    """Process 0's side of the mirrored calls of one Runner: `role` "target" (the served
    model's) or "draft" (--model-draft's)."""

    def __init__(self, role: str = "target") -> None:
        self.role = role
        self._lost = False

    def send(self, name: str, args: tuple, kwargs: dict) -> None:
        """Every follower makes the call `name`(*args, **kwargs) on its Runner of the same
        role."""
        _broadcast(pickle.dumps((self.role, name, args, kwargs),
                                protocol=pickle.HIGHEST_PROTOCOL))

    def lost(self, reason: str) -> None:
        """The engine failed (a process stopped, most likely): exit after GRACE_SECONDS,
        which leaves the failed requests' error events time to reach their clients.
        os._exit: jax.distributed's own exit waits for every process."""
        if self._lost:
            return
        self._lost = True
        print(f"kinetic: the model's processes cannot go on ({reason}); exiting",
              file=sys.stderr, flush=True)

        def leave() -> None:
            time.sleep(GRACE_SECONDS)
            sys.stdout.flush()
            os._exit(1)
        threading.Thread(target=leave, daemon=True, name="kinetic-exit").start()


def receive() -> tuple[str, str, tuple, dict]:
    """The leader's next call (a follower's side of Leader.send): role, name, args,
    kwargs."""
    return pickle.loads(_broadcast(None))


def _broadcast(payload: bytes | None) -> bytes:
    """payload from the leader to every process (None on a follower): a first message of
    FIRST bytes (the length, then the payload's start) and the rest, if any, in a second of
    a power-of-two size (each size a compiled sum of its own)."""
    from jax.experimental import multihost_utils
    first = np.zeros(FIRST, np.uint8)
    if payload is not None:
        head = len(payload).to_bytes(4, "little") + payload[:FIRST - 4]
        first[:len(head)] = np.frombuffer(head, np.uint8)
    first = np.asarray(multihost_utils.broadcast_one_to_all(first))
    size = int.from_bytes(first[:4].tobytes(), "little")
    data = first[4:4 + size].tobytes()
    rest = size - len(data)
    if rest > 0:
        more = np.zeros(1 << (rest - 1).bit_length(), np.uint8)
        if payload is not None:
            more[:rest] = np.frombuffer(payload[FIRST - 4:], np.uint8)
        data += np.asarray(multihost_utils.broadcast_one_to_all(more))[:rest].tobytes()
    return data


def follow(model, draft=None) -> int:
    """A follower's life, once its LoadedModel (and --model-draft's, `draft`) is read: the
    leader's Runner config, then every mirrored call the leader sends, made on a Runner of
    its own of the same role, until the target's "close". Returns the exit status."""
    from kinetic.engine.runner import Runner
    wait_for_all("loaded")
    runners: dict[str, Runner] = {}
    while True:
        role, name, args, kwargs = receive()
        if name == "close" and role == "target":
            print(f"kinetic: process {_index()} stopped with the leader", file=sys.stderr,
                  flush=True)
            return 0
        if name == "__init__":
            runners[role] = _runner(model if role == "target" else draft, role, *args)
            continue
        if role not in runners:
            raise RuntimeError(f"the leader's call {name!r} came before its {role} runner's "
                               f"config")
        getattr(runners[role], name)(*args, **kwargs)


def _runner(model, role: str, config, leader_model):
    """This process's Runner of `role` over `model`, checked to be the leader's model."""
    from kinetic.engine.runner import Runner
    if model is None:
        raise ValueError(f"process {_index()}: the leader drafts with --model-draft; give "
                         f"every process the same flags")
    if leader_model != model.config:
        raise ValueError(f"process {_index()} loaded another {role} model than the leader's "
                         f"(every process serves the same GGUF file with the same flags)")
    runner = Runner(model, config, role=role)
    if role == "target":
        print(f"kinetic: process {_index()} of {_count()} follows the leader, split by "
              f"{runner.split['mode']} over {runner.split['devices']} devices",
              file=sys.stderr, flush=True)
    return runner


def _index() -> int:
    import jax
    return jax.process_index()


def _count() -> int:
    import jax
    return jax.process_count()
