"""`parallel.cpu.paused`: the CUDA->CPU function mode is off inside the block (a torch call
naming CUDA then fails as plain torch would on a CPU-only machine) and back after it, also when
the block raises; with another mode innermost it is left alone."""
import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from megaprm.parallel import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is CPU-only")


def _redirected() -> bool:
    try:
        return torch.zeros(1, device="cuda").device.type == "cpu"
    except (RuntimeError, AssertionError):  # torch without CUDA refuses the device
        return False


def test_paused_turns_the_mode_off_and_back_on():
    cpu.install()
    assert _redirected()
    depth = len(_get_current_function_mode_stack())
    with cpu.paused():
        assert not _redirected()
        assert len(_get_current_function_mode_stack()) == depth - 1
    assert _redirected() and len(_get_current_function_mode_stack()) == depth
    with pytest.raises(ValueError), cpu.paused():
        raise ValueError("inside")
    assert _redirected()


def test_paused_leaves_a_mode_that_is_not_innermost():
    cpu.install()

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Other(), cpu.paused():
        assert _redirected()  # the CUDA->CPU mode below `Other` still applies
