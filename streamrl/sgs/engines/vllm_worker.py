"""What the vLLM engine runs inside vLLM's worker process (``worker_extension_cls``).

When vLLM's engine core runs in a child process (``multiprocessing=True``, the GPU default), a
``collective_rpc`` argument crosses a msgpack socket that rebuilds a tensor only where a message
type names one; in an untyped argument list a tensor arrives as a list. So the engine sends
handles (``as_handles``: shared CPU memory, or CUDA IPC on a GPU) and ``load_named_tensors``
opens them here and hands vLLM's ``reload_weights`` the named tensors: in memory, no file. In
process (the CPU default) the engine passes the tensors themselves and this module is not used.
Imports torch only: vLLM imports this class when it builds its worker.
"""

from __future__ import annotations

from typing import Any


def as_handles(tensors: dict[str, Any]) -> bytes:
    """The named tensors as handles, not bytes: torch's multiprocessing reductions put a CPU
    tensor's storage in shared memory and send its descriptor, and send a CUDA tensor's IPC
    handle (the receiver maps the same device memory). The caller keeps ``tensors`` alive until
    the receiver has loaded them."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import init_reductions

    init_reductions()  # torch's reductions registered with ForkingPickler (idempotent)
    buf = io.BytesIO()
    ForkingPickler(buf, 5).dump([(name, t.detach()) for name, t in tensors.items()])
    return buf.getvalue()


class WeightLoader:
    """Mixed into vLLM's worker class by vLLM (``self`` is the worker)."""

    def load_named_tensors(self, handles: bytes) -> int:
        """Reload the model's weights from ``as_handles``' bytes; returns how many tensors loaded."""
        import pickle

        tensors = pickle.loads(handles)  # torch's rebuild functions are imported by name
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]  # the worker's method
        return len(tensors)
