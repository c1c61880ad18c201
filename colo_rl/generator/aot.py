"""vLLM's AOT compile cache for models on its Transformers backend (issue #23).

vLLM saves the torch.compile'd model (an "AOT compiled function") so that the next engine start of
the same shape loads it instead of tracing the model with Dynamo again (seconds of every start
on a GPU). On the Transformers backend (OLMo-2 under vLLM 0.26) the save fails: "Can't pickle <function
Olmo2Model.forward>: it's not the same object as transformers...Olmo2Model.forward". Transformers
wraps its forwards in decorators (functools.wraps), so the traced function's module and qualname
name its wrapper, and torch's AOT pickler (torch 2.11, which vLLM 0.26 pins) saves functions by
reference, rebuilding from the code object only those whose qualname says `<locals>`. torch later
rebuilds every function whose name does not resolve back to it (pytorch/pytorch#196454); install()
does the same in this process and the processes it forks (vLLM's engine core).

On by default in the engine worker (COLO_RL_AOT_REBUILD=0 turns it off): the first start saves
the compiled model, every later start of the same shape loads it, so both Dynamo's tracing and
torch.compile's work shrink and the first step comes sooner.
"""

from __future__ import annotations

import importlib
import inspect
import types


def rebuild_function(code: types.CodeType, module: str, name: str, qualname: str, defaults: tuple | None,
                     kwdefaults: dict | None, closure: tuple | None) -> types.FunctionType:
    """The function saved by install()'s reducer: its code in its module's globals, with its
    defaults and closure cells (pickled on their own)."""
    fn = types.FunctionType(code, importlib.import_module(module).__dict__, name, defaults, closure)
    fn.__qualname__ = qualname
    fn.__kwdefaults__ = kwdefaults
    return fn


def resolves(fn: types.FunctionType) -> bool:
    """Whether pickle's save-by-reference finds `fn` itself at its module and qualname."""
    try:
        obj = importlib.import_module(fn.__module__)
        for part in fn.__qualname__.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - any failure means "not by reference"
        return False
    return obj is fn


def install() -> bool:
    """Make torch's AOT pickler save, by code, every function that its name does not resolve to;
    False where this torch has no such pickler (nothing to do)."""
    try:
        from torch._dynamo.aot_compile import AOTCompilePickler
    except ImportError:
        return False
    original = AOTCompilePickler.reducer_override
    if getattr(original, "_colo_rl", False):
        return True

    def reducer_override(self, obj):
        if inspect.isfunction(obj) and "<locals>" not in obj.__qualname__ and not resolves(obj):
            return rebuild_function, (obj.__code__, obj.__module__, obj.__name__, obj.__qualname__,
                                      obj.__defaults__, obj.__kwdefaults__, obj.__closure__)
        return original(self, obj)

    reducer_override._colo_rl = True
    AOTCompilePickler.reducer_override = reducer_override
    return True
