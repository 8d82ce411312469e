"""The graph runner of a tensor-parallel export: one worker process per rank, each running its rank's programs.

The workers are fresh interpreters (`python -m optimum_qwen35.runtime.tp_worker`), each holding one rank's runner (a
cpu export's `ExportedGraphs` by default, or the runner class a backend names, e.g. TorchNeuron's: its weights and
its state, as the state stays on the device on Neuron) and joined by a process group (gloo, or the backend's) over a
file store; each talks to this process over its own socket pair. `WorkerPool.run` sends every rank the same inputs and
returns rank 0's logits; speculative decoding's steps (`verify`, `commit`, ...) go to every rank the same way. For a
prefix cache (runtime/prefix_cache.py), `take_block` brings one slot's block snapshot of every rank to this process
(rank 0's tensors, then rank 1's, ...: one cache entry holds the whole model's) and `restore_blocks` sends each rank
its share back.
"""

from __future__ import annotations

import importlib
import json
import os
import logging
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from optimum_qwen35.errors import Qwen35Error, WorkerLostError
from optimum_qwen35.runtime.exported import ProgramRunner, read_graphs_manifest

logger = logging.getLogger(__name__)


def _send(conn, obj) -> None:
    """Plain pickle over the socket: multiprocessing's own pickler would pass torch tensors as shared-memory
    handles, which only processes of one multiprocessing family may open."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _portable(error: BaseException):
    """What a worker reports: this package's errors as themselves (the parent re-raises them), others as text."""
    if isinstance(error, Qwen35Error):
        try:
            pickle.dumps(error)
            return error
        except Exception:  # noqa: BLE001
            pass
    return traceback.format_exc()


# Speculative decoding's steps (runtime/exported.py `SpeculativePrograms`), which every rank runs on its own programs
# and state: verify's per-position DeltaNet states stay in each worker until its commit.
SPECULATIVE_STEPS = ("context_hidden", "verify", "commit", "mtp")

# The runner a worker builds unless told otherwise: a cpu export's programs.
EXPORTED_RUNNER = "optimum_qwen35.runtime.exported:ExportedGraphs"


def rank_runner(path: str):
    """The runner class named "module:Class" (a name, not a class, crosses the process boundary; the worker imports
    the backend's module itself, so this module imports no backend)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def serve_rank(rank: int, tp_degree: int, store_file: str, folder: str, conn, runner: str = EXPORTED_RUNNER,
               dist_backend: str = "gloo", options: dict | None = None) -> None:
    """A tensor-parallel rank: load, say ready, then run what the parent sends until it sends None. `runner`: the
    rank's runner class ("module:Class"), built as `Class(folder, rank, **options)`."""
    try:
        dist.init_process_group(dist_backend, init_method=f"file://{store_file}", rank=rank, world_size=tp_degree)
        graphs = rank_runner(runner)(folder, rank, **(options or {}))
        if dist.group.WORLD.group_name != graphs.manifest["group_name"]:
            raise RuntimeError(f"process group {dist.group.WORLD.group_name!r} is not the graphs' {graphs.manifest['group_name']!r}")
        _send(conn, ("ready", None))
    except BaseException as error:  # noqa: BLE001 (reported to the parent, which raises it)
        _send(conn, ("error", _portable(error)))
        return
    try:
        while True:
            try:
                message = _recv(conn)
            except EOFError:  # the parent exited without close() (e.g. vLLM's engine shut down): stop quietly
                break
            if message is None:
                break
            op, args = message
            try:
                if op == "run":  # (name, inputs, restore): a graph call; rank 0 returns the logits
                    name, inputs, restore = args
                    logits = graphs.run(name, *inputs, restore=restore)
                    _send(conn, ("ok", logits if rank == 0 else None))
                elif op == "take_block":  # (slot, start, end): this rank's share of the snapshot
                    _send(conn, ("ok", graphs.take_block(*args)))
                elif op == "restore_blocks":  # (slot, this rank's share of each snapshot, block size)
                    graphs.restore_blocks(*args)
                    _send(conn, ("ok", None))
                elif op in SPECULATIVE_STEPS:  # the step's inputs; rank 0 returns its outputs
                    out = getattr(graphs, op)(*args)
                    _send(conn, ("ok", out if rank == 0 else None))
                else:
                    raise RuntimeError(f"unknown message {op!r}")
            except BaseException as error:  # noqa: BLE001
                _send(conn, ("error", _portable(error)))
    finally:
        dist.destroy_process_group()


class WorkerPool(ProgramRunner):
    """t ranks in t worker processes (a process group over a file store); `run` sends every rank the same inputs.
    `runner` ("module:Class"), `dist_backend` and `options` (JSON-able keywords of the runner) say what each worker
    runs: a cpu export's programs over gloo by default.

    The workers are fresh interpreters (`python -m optimum_qwen35.runtime.tp_worker`), each talking to this
    process over its own socket pair: unlike multiprocessing's spawn, they never re-import the caller's
    main module, so a script needs no `if __name__ == "__main__":` guard.

    A call waits on every worker's socket at once and wakes up at least every `POLL_SECONDS`: a worker that dies
    (killed, crashed) ends the call within a second with `WorkerLostError` (one line naming the rank and how it
    ended), where a blocking read of rank 0 would wait forever on its collective with the dead rank. A call that
    does not complete (a lost worker, or a KeyboardInterrupt while the workers run) leaves them mid-step: every
    worker is stopped, `state_epoch` goes up (the host loop then forgets what its slots held: runtime/host_loop.py)
    and the next call starts the workers again (`restarts` counts it).
    """

    POLL_SECONDS = 0.5

    def __init__(self, folder: str | os.PathLike, tp_degree: int, manifest: dict | None = None,
                 runner: str = EXPORTED_RUNNER, dist_backend: str = "gloo", options: dict | None = None):
        self.manifest = manifest or read_graphs_manifest(folder)
        self.folder = folder  # (names the export a prefix cache belongs to: ProgramRunner.prefix_cache_owner)
        self.tp_degree = tp_degree
        self._runner, self._dist_backend, self._options = runner, dist_backend, options
        self._conns, self._procs = [], []
        self._tmp = None
        self._lock = threading.Lock()
        self._lost: str | None = None  # why the last call did not complete (the workers are stopped)
        self.state_epoch = 0  # goes up each time the workers' state is lost
        self.restarts = 0  # times the workers were started again after that
        self._start()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank by rank (none while the workers are stopped after a lost call)."""
        return [proc.pid for proc in self._procs]

    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="qwen35-tp-")
        threads = max(1, (os.cpu_count() or 1) // self.tp_degree)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        store = os.path.join(self._tmp.name, "store")
        for rank in range(self.tp_degree):
            ours, theirs = socket.socketpair()
            command = [sys.executable, "-m", "optimum_qwen35.runtime.tp_worker", os.fspath(self.folder), str(rank),
                       str(self.tp_degree), store, str(theirs.fileno()), str(threads), self._runner,
                       self._dist_backend, json.dumps(self._options or {})]
            self._procs.append(subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            self._conns.append(Connection(ours.detach()))
        try:
            self._collect("loading")
        except BaseException:
            self._stop(kill=True)
            raise

    def _collect(self, what: str) -> list:
        """Every rank's answer, in rank order, read as they come. A rank whose socket closes (its process ended)
        stops every worker and raises `WorkerLostError` (`RuntimeError` while loading)."""
        answers: dict[int, tuple] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            ready = wait(list(pending.values()), timeout=self.POLL_SECONDS)
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        answers[rank] = _recv(conn)
                    except (EOFError, OSError):
                        self._worker_ended(rank, what)
                    del pending[rank]
                elif self._procs[rank].poll() is not None:  # (its socket closes too; this is the slower net)
                    self._worker_ended(rank, what)
        results, errors, package_errors = [], [], []
        for rank in range(len(self._conns)):
            status, value = answers[rank]
            if status == "error":
                if isinstance(value, Qwen35Error):
                    package_errors.append(value)  # user-fixable (e.g. weights that do not match): raised as is
                else:
                    errors.append(f"rank {rank}: {value}")
            results.append(value)
        if package_errors:
            raise package_errors[0]
        if errors:
            raise RuntimeError("tensor-parallel worker failed:\n" + "\n".join(errors))
        return results

    def _worker_ended(self, rank: int, what: str):
        proc = self._procs[rank]
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = ("closed its socket" if code is None else f"was killed by signal {signal.Signals(-code).name}"
               if code < 0 else f"exited with code {code}")
        if what == "loading":
            raise RuntimeError(f"tensor-parallel worker failed:\nrank {rank}: {how}")
        raise WorkerLostError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how} during {what}: the call is lost, and so is "
            f"the state of every slot; the next call starts the {self.tp_degree} workers again"
        )

    def _round(self, what: str, messages: list) -> list:
        """Send rank r messages[r], collect every answer. A round that does not complete stops the workers."""
        with self._lock:
            if self._lost is not None:
                logger.warning("starting the tensor-parallel workers again after a lost call (%s)", self._lost)
                self._start()
                self._lost = None
                self.restarts += 1
            try:
                for rank, (conn, message) in enumerate(zip(self._conns, messages)):
                    try:
                        _send(conn, message)
                    except OSError:  # its end of the socket is closed: the worker died since the last call
                        self._worker_ended(rank, what)
                return self._collect(what)
            except (Qwen35Error, RuntimeError) as error:
                if not isinstance(error, WorkerLostError):
                    raise  # every rank answered (an error in a graph call): the workers are in step
                self._lose(str(error))
                raise
            except BaseException as error:  # KeyboardInterrupt, a broken socket, ...: some answers are unread
                self._lose(f"{type(error).__name__} during {what}")
                raise

    def _lose(self, why: str) -> None:
        self._stop(kill=True)
        self._lost = why
        self.state_epoch += 1

    def _on_every_rank(self, op: str, args: tuple):
        """Send every rank the same message; rank 0's answer."""
        return self._round(op, [(op, args)] * self.tp_degree)[0]

    def run(self, name: str, *inputs: torch.Tensor, restore: list[int] | None = None) -> torch.Tensor:
        return self._round(name, [("run", (name, inputs, restore))] * self.tp_degree)[0]

    # Speculative decoding (an export made with mtp=True): the host loop's steps, run by every rank.
    def context_hidden(self, *args):
        return self._on_every_rank("context_hidden", args)

    def verify(self, *args):
        return self._on_every_rank("verify", args)

    def commit(self, *args) -> None:
        self._on_every_rank("commit", args)

    def mtp(self, *args):
        return self._on_every_rank("mtp", args)

    # A prefix cache's snapshots of a slot (runtime/prefix_cache.py): every rank's share, rank after rank.
    def take_block(self, slot: int, start: int, end: int) -> list[torch.Tensor]:
        shares = self._round("take_block", [("take_block", (slot, start, end))] * self.tp_degree)
        return [tensor for share in shares for tensor in share]

    def restore_blocks(self, slot: int, snapshots: list[list[torch.Tensor]], block_size: int) -> None:
        n = len(self.manifest["state"])  # state tensors per rank
        messages = [("restore_blocks", (slot, [snapshot[rank * n : (rank + 1) * n] for snapshot in snapshots],
                                        block_size)) for rank in range(self.tp_degree)]
        self._round("restore_blocks", messages)

    def _stop(self, kill: bool = False) -> None:
        """Ask every worker to stop and wait for it (`kill`: kill them at once, as after a lost call, where a worker
        may wait forever in a collective with a dead rank), then drop the sockets and the store."""
        for proc, conn in zip(self._procs, self._conns):
            if kill:
                proc.kill()
            else:
                try:
                    _send(conn, None)
                except OSError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def close(self) -> None:
        self._stop()

    def __del__(self):
        if getattr(self, "_procs", None):
            self.close()
