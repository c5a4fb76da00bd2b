"""What the CUDA copy engine asks of CUDA, as one object (`CudaApi`), and torch's (`TorchCuda`).

The one seam of the CUDA path: streams, events, the compute stream, a device-wide synchronize,
the driver (batched and per-piece copies, host registration) and the self-check's buffers. The
engine and `PrimaryRegion.pin` take it as an argument; tests hand in a fake that keeps to what
CUDA guarantees and nothing more (tests/helpers/fake_cuda.py). Importing this module needs
neither CUDA nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from tiers.copy.cuda_driver import CudaDriver

if TYPE_CHECKING:
    import torch

__all__ = ["CudaApi", "CudaEvent", "CudaStream", "TorchCuda"]


class CudaStream(Protocol):
    """A CUDA stream as torch's `torch.cuda.Stream` offers it (worker process)."""

    @property
    def cuda_stream(self) -> int: ...

    def wait_event(self, event: Any) -> None:
        """Work queued later waits for the event's most recent record as of this call."""

    def synchronize(self) -> None: ...


class CudaEvent(Protocol):
    """A CUDA event as torch's `torch.cuda.Event` offers it (worker process)."""

    def record(self, stream: Any) -> None: ...

    def query(self) -> bool:
        """Whether the stream has reached the most recent record (True if never recorded)."""

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to `end`; both complete and timing-enabled."""

    def synchronize(self) -> None: ...


class CudaApi(Protocol):
    """CUDA on one device, as the copy engine uses it (worker process, the engine's thread)."""

    driver: CudaDriver
    device_index: int

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in this device's memory."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is host memory registered with (or allocated by) CUDA."""

    def stream(self) -> Any:
        """A stream for copies (a `CudaStream`)."""

    def event(self, timing: bool) -> Any:
        """A fresh event (a `CudaEvent`); `timing` for `elapsed_time`."""

    def current_stream(self) -> Any:
        """The stream the caller's kernels are queued on (vLLM's compute stream)."""

    def synchronize(self) -> None:
        """Wait for everything queued on the device."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor (a kernel launch: raises a pending CUDA error)."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` zeroed bytes of pinned host memory."""


class TorchCuda:
    """`CudaApi` through torch and libcuda: worker process, the engine's thread.

    Needs a machine with CUDA; the fake of the tests stands in for it elsewhere.
    """

    def __init__(self, device: torch.device, driver: CudaDriver | None = None) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.device_index = device.index if device.index is not None else 0
        self.driver = driver if driver is not None else CudaDriver()

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    def stream(self) -> Any:
        return self._torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def event(self, timing: bool) -> Any:
        return self._torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:
        return self._torch.cuda.current_stream(self.device)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self._torch.zeros(nbytes, dtype=self._torch.uint8).pin_memory()
