"""The asynchronous I/O engine: non-blocking disk reads/writes and host<->device copies, returning handles.

Disk I/O: a pool of ``queue_depth`` threads, each issuing one ``os.preadv``/``os.pwritev`` of at most
``block_size`` bytes at a time, so ``queue_depth`` requests are in flight, like an io_uring/libaio queue of
that depth. Python releases the GIL inside those calls and inside xxh3 hashing, so the threads overlap.

Copies: one thread per direction (host->device, device->host). With CUDA each issues its copies on its own
stream (one per direction and device) and waits on an event, so copies overlap compute on the default
stream; without CUDA the copy is a plain memcpy on that thread. A handle completes only once its copy's data
has arrived, so the host may read a copied-out buffer, pinned or not, as soon as the handle is done.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tiertune.errors import ConfigError, StateError
from tiertune.offload.chunk import ALIGN

log = logging.getLogger("tiertune.offload")


class IOHandle:
    """A transfer in flight, made of one or more parts. ``wait()`` blocks until all are done.

    Callbacks added with ``add_done_callback`` run once, on the thread that finished the last part
    (or at once if already done); they must not block.
    """

    def __init__(self, label: str, parts: int = 0) -> None:
        self.label = label
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._remaining = parts
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IOHandle], None]] = []
        if parts == 0:
            self._event.set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; re-raise the first error of any part."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.label}: not done after {timeout}s")
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn: Callable[[IOHandle], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def part_done(self, error: BaseException | None = None) -> None:
        """One part finished (``error``: it failed); the last runs the callbacks."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            if self._remaining > 0:
                return
            callbacks, self._callbacks = self._callbacks, []
            self._event.set()
        interrupted: BaseException | None = None
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's failure must not vanish inside an executor thread
                log.exception("completion callback of %s failed", self.label)
            except BaseException as exc:
                # a signal raised as ``KeyboardInterrupt`` where the callbacks run on the main thread (a
                # ledger's transfers, or a handle done before its callback was added): the other callbacks
                # still run, so no chunk waits for a completion that was dropped, then it goes on up
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"IOHandle({self.label!r}, {state})"


def buffer_of(tensor: torch.Tensor) -> memoryview:
    """A writable, zero-copy memoryview of a contiguous CPU tensor's bytes (for preadv/pwritev)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise StateError("disk I/O needs a contiguous CPU buffer")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes of ``fd`` at ``offset`` into ``view`` (a ``preadv`` may return fewer); returns
    how many were read before the file's end (the caller says what a short read means)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


class AsyncIO:
    """Runs block-sized disk requests ``queue_depth`` at a time and copies on per-direction threads."""

    def __init__(self, queue_depth: int = 16, block_size: int = 1 << 20) -> None:
        if queue_depth < 1:
            raise ConfigError(f"queue_depth must be >= 1, got {queue_depth}")
        if block_size < ALIGN or block_size % ALIGN:
            raise ConfigError(f"block_size must be a positive multiple of {ALIGN} bytes, got {block_size}")
        self.queue_depth = queue_depth
        self.block_size = block_size
        self._disk = ThreadPoolExecutor(queue_depth, thread_name_prefix="tiertune-aio")
        self._h2d = ThreadPoolExecutor(1, thread_name_prefix="tiertune-h2d")
        self._d2h = ThreadPoolExecutor(1, thread_name_prefix="tiertune-d2h")
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self._closed = False

    def run(self, label: str, tasks: Sequence[Callable[[], None]]) -> IOHandle:
        """Run ``tasks`` (each one block request) on the disk queue; the handle completes when all have."""
        self._check_open()
        handle = IOHandle(label, len(tasks))
        for task in tasks:
            self._disk.submit(_run_part, handle, task)
        return handle

    def then(self, first: IOHandle, label: str, tasks: Callable[[], list[Callable[[], None]]]) -> IOHandle:
        """A handle for ``tasks()`` run on the disk queue once ``first`` succeeded (e.g. a header write)."""
        outer = IOHandle(label, 1)

        def next_step(done: IOHandle) -> None:
            if done.error is not None:
                outer.part_done(done.error)
                return
            try:
                second = self.run(label, tasks())
            except BaseException as exc:
                outer.part_done(exc)
                return
            second.add_done_callback(lambda h: outer.part_done(h.error))

        first.add_done_callback(next_step)
        return outer

    def blocks(self, nbytes: int) -> list[tuple[int, int]]:
        """Split ``nbytes`` into [start, end) ranges of at most ``block_size``."""
        return [(a, min(a + self.block_size, nbytes)) for a in range(0, nbytes, self.block_size)]

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, label: str, after: torch.cuda.Event | None = None
    ) -> IOHandle:
        """Copy ``src`` into ``dst`` off the caller's thread (and, with CUDA, off its stream).

        ``after``: a CUDA event the copy stream waits for first: the compute stream's last use of the device
        side (its writes to ``src`` before a copy out; its reads of ``dst`` before a copy in).
        """
        self._check_open()
        to_device = dst.device.type != "cpu"
        executor = self._h2d if to_device else self._d2h
        cuda = dst.device.type == "cuda" or src.device.type == "cuda"
        handle = IOHandle(label, 1)

        def do_copy() -> None:
            if not cuda:
                dst.copy_(src)
                return
            device = dst.device if to_device else src.device
            key = ("h2d" if to_device else "d2h", device)  # a stream belongs to one device
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                dst.copy_(src, non_blocking=True)
                # blocking: this thread sleeps until the copy is done instead of spinning a core (the
                # default), which the CPU optimizer and the disk threads need
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
            done.synchronize()  # the data has arrived (for a pageable destination too) before the handle is done

        executor.submit(_run_part, handle, do_copy)
        return handle

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the I/O engine is closed")

    def close(self) -> None:
        """Finish what is queued and stop the threads."""
        if self._closed:
            return
        self._closed = True
        for pool in (self._disk, self._h2d, self._d2h):
            pool.shutdown(wait=True)


def _run_part(handle: IOHandle, task: Callable[[], None]) -> None:
    try:
        task()
    except BaseException as exc:
        handle.part_done(exc)
    else:
        handle.part_done(None)
