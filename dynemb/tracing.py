"""How dynamic collections appear to ``torch.fx`` tracing and to ``torch.jit.script``.

A dynamic collection's forward runs numba kernels and host-side bookkeeping (hash tables,
pins, a prefetch queue) that no graph can express. So:

- **fx tracing** (``torchrec.fx.symbolic_trace``, ``torch.fx.symbolic_trace``, the tracing
  TorchRec's pipelines do): the module is a leaf. Its forward, given a ``Proxy``, records
  one ``call_module`` node instead of running (:func:`call_as_leaf`); the traced
  ``GraphModule`` calls the very same module object, so it looks up and trains the same
  tables as the eager model. Code after it sees a ``Proxy`` for the output and traces on.
- **TorchScript**: refused at once, naming the supported way (:class:`ScriptingRefused`):
  export the tables with :func:`dynemb.serving.to_static`, which gives TorchRec's own
  ``EmbeddingCollection`` / ``EmbeddingBagCollection`` holding the trained rows and an
  ``IdRemap`` per table from raw ids to rows, and script those.

Example::

    >>> import torch.fx
    >>> class Model(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.ec = DynamicEmbCollection(tables=[EmbeddingConfig(
    ...             name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
    ...     def forward(self, kjt):
    ...         return self.ec(kjt)["f"].values().sum()
    >>> graph = torch.fx.symbolic_trace(Model()).graph
    >>> [n.target for n in graph.nodes if n.op == "call_module"]
    ['ec']
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

#: What a refused ``torch.jit.script`` says to do instead.
SCRIPTING_HINT = (
    "its forward runs numba kernels and host-side hash-table bookkeeping, which TorchScript "
    "cannot compile. For inference, export the trained tables with "
    "dynemb.serving.to_static(module): it returns TorchRec's EmbeddingCollection / "
    "EmbeddingBagCollection holding the rows and one IdRemap per table (raw ids -> rows), "
    "which script; for training, run the module eagerly, under torch.compile, or traced by "
    "torchrec.fx.symbolic_trace (where it is a leaf)")


def is_traced(value: Any) -> bool:
    """Whether ``value`` is a ``torch.fx`` ``Proxy``: the module is being symbolically
    traced and its forward must record itself rather than run.

    Example::

        >>> is_traced(torch.zeros(1))
        False
    """
    return isinstance(value, torch.fx.Proxy)


def call_as_leaf(module: torch.nn.Module, *args: torch.fx.Proxy) -> torch.fx.Proxy:
    """Record ``module(*args)`` as one ``call_module`` node of the graph being traced and
    return its output ``Proxy``: what the tracer does for the modules it treats as leaves.

    Called from a forward that received a ``Proxy`` (:func:`is_traced`), so it works under
    any tracer (TorchRec's, ``torch.fx``'s, a pipeline's) without being listed among its
    leaf modules. The module must be a submodule of the traced root: traced alone, it would
    leave a graph holding nothing but a call of itself, so that raises ``TypeError``.
    """
    tracer = args[0].tracer
    path = tracer.path_of_module(module)
    if not path:
        raise TypeError(
            f"a {type(module).__name__} cannot be the root of a symbolic trace: its lookups "
            f"run outside any graph. Trace the model that holds it (there it is one "
            f"call_module node), or call it directly")
    return tracer.create_proxy("call_module", path, tuple(args), {})


class ScriptingRefused:
    """Mixin for modules that ``torch.jit.script`` cannot compile: scripting them, alone or
    inside a model, raises one ``RuntimeError`` that names the module and the supported way
    (:data:`SCRIPTING_HINT`) instead of an error from deep inside their forward.

    ``torch.jit.script`` calls ``__prepare_scriptable__`` on the model and each submodule
    before compiling anything, so nothing has been compiled or changed when it raises.

    Example::

        >>> ec = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
        >>> torch.jit.script(torch.nn.Sequential(ec))
        Traceback (most recent call last):
        RuntimeError: torch.jit.script cannot compile DynamicEmbCollection: ...
    """

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"torch.jit.script cannot compile {type(self).__name__}: {SCRIPTING_HINT}")
