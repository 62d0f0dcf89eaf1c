"""NaN forensics: where in the model a reproducible non-finite value is born.

On an incident with ``diagnose.rerun``, the first isolation re-run of the bad step (the
whole step, on the origin ranks) runs with a hook on every submodule, attached for that
re-run only: the first module, in execution order, whose forward output holds a non-finite
value is the origin; if every output was finite, the first module in backward order whose
input gradient is non-finite (where the re-run runs backward). Cost: zero in healthy steps
(no hook exists then), a few microseconds per module during that one re-run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def _nonfinite(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, (tuple, list)):
        return any(_nonfinite(o) for o in obj)
    if isinstance(obj, dict):
        return any(_nonfinite(o) for o in obj.values())
    return False


class ModuleLocator:
    """Hooks on every named submodule of ``root`` while attached (a context manager)."""

    def __init__(self, root: nn.Module, backward: bool) -> None:
        self.root = root
        self.backward = backward
        self.forward_hit: str | None = None
        self.backward_hit: str | None = None
        #: Some module ran under autocast (the loop body's own ``torch.autocast``): the
        #: step ran in low precision although the parameters may be fp32.
        self.autocast = False
        self._device = next((p.device.type for p in root.parameters()), "cpu")
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> ModuleLocator:
        for name, module in self.root.named_modules():
            if not name:
                continue  # the root's output is the loss's input: not a location
            self._handles.append(module.register_forward_hook(self._on_forward(name)))
            if self.backward:
                self._handles.append(module.register_full_backward_hook(self._on_backward(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_forward(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.forward_hit is None and _nonfinite(output):
                self.forward_hit = name
            if not self.autocast and torch.is_autocast_enabled(self._device):
                self.autocast = True

        return hook

    def _on_backward(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if self.backward_hit is None and _nonfinite(grad_input):
                self.backward_hit = name

        return hook

    @property
    def result(self) -> dict[str, str] | None:
        if self.forward_hit is not None:
            return {"module": self.forward_hit, "direction": "forward"}
        if self.backward_hit is not None:
            return {"module": self.backward_hit, "direction": "backward"}
        return None


def low_precision(root: nn.Module) -> bool:
    """The model holds fp16 or bf16 parameters (what the fp32 re-run can tell apart)."""
    return any(p.dtype in (torch.float16, torch.bfloat16) for p in root.parameters())


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off for every device type, and kept off inside the loop body's own
    ``torch.autocast`` contexts, until exit (then everything as it was).

    An outer ``autocast(enabled=False)`` does not do it: autocast is a thread-local switch
    (its dispatch key excluded or not) that every ``autocast.__enter__`` sets again, so the
    user's ``with torch.autocast("cuda", dtype=torch.bfloat16)`` inside turns it back on
    (likewise ``torch._C._set_autocast_enabled`` or a dispatch-key guard). Every autocast
    context, of any device type and any subclass (``torch.cuda.amp.autocast`` too), enables
    itself through ``torch.set_autocast_enabled``: that is replaced, for this context only,
    by one that always sets False. Process-wide while it lasts (one forensics re-run, on
    the training thread; the Guard's own threads use no autocast). Not covered: a model
    compiled with autocast inside its graph (``torch.compile``), and code calling
    ``torch._C._set_autocast_enabled`` itself."""
    real = torch.set_autocast_enabled
    devices = ("cpu", "cuda", "xpu", "mps", "hpu")
    before = {}
    for d in devices:
        with contextlib.suppress(RuntimeError):  # a device type this build does not know
            before[d] = torch.is_autocast_enabled(d)

    def never(*args: Any, **kwargs: Any) -> None:
        if "enabled" in kwargs:
            kwargs["enabled"] = False
        elif args:
            args = (*args[:-1], False)
        real(*args, **kwargs)

    try:
        for d in before:
            real(d, False)
        torch.set_autocast_enabled = never
        yield
    finally:
        torch.set_autocast_enabled = real
        for d, enabled in before.items():
            real(d, enabled)


@contextlib.contextmanager
def full_precision(root: nn.Module) -> Iterator[None]:
    """fp32 copies of every low-precision parameter and buffer, autocast off (even inside
    the loop body's own ``torch.autocast``, :func:`autocast_off`), for one forward; the
    originals (same tensors, same storage) are back afterwards.

    A parameter is replaced by an fp32 copy in its module, never changed in place: setting
    a parameter's ``.data`` to another dtype drops its gradient accumulator, and DDP's
    gradient hooks hang on that accumulator. After such a swap and back, DDP never again
    all-reduced those gradients and the replicas drifted apart, silently (found by the
    replica digest, orchestrator/replicas.py). A copy's gradients are never wanted: the
    fp32 re-run is judged by its loss alone."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    saved = []
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                module._parameters[name] = nn.Parameter(p.detach().float(), p.requires_grad)
                swapped.append((module, name, p))
        for t in module.buffers(recurse=False):  # no gradient accumulator to lose
            if t.is_floating_point() and t.dtype != torch.float32:
                saved.append((t, t.data))
                t.data = t.data.float()
    try:
        with autocast_off():
            yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
        for t, data in saved:
            t.data = data
