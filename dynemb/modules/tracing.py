"""How dynamic collections appear to ``torch.fx`` tracing and to ``torch.jit.script``.

A dynamic collection's forward runs numba kernels and host-side bookkeeping (hash tables,
pins, a prefetch queue) that no graph can express. So:

- **fx tracing** (``torchrec.fx.symbolic_trace``, ``torch.fx.symbolic_trace``, the tracing
  TorchRec's pipelines do): the module is a leaf. Its forward, given a ``Proxy``, records
  one ``call_module`` node instead of running (:func:`call_as_leaf`); the traced
  ``GraphModule`` calls the very same module object, so it looks up and trains the same
  tables as the eager model. Code after it sees what it sees after TorchRec's module:
  for a sequence collection a dict of one ``Proxy`` per output name, which it may iterate
  (:func:`traced_outputs`), for a pooled one a ``Proxy`` of the ``KeyedTensor``. Traced as
  the root, the module becomes the ``GraphModule``'s child ``collection``
  (:data:`ROOT_CALL_NAME`), which the graph calls.
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

from typing import Any, Dict, List

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


#: The name under which a ``GraphModule`` traced from a dynamic module itself (the module
#: as the root of the trace) holds and calls that module: ``gm.collection``.
ROOT_CALL_NAME = "collection"


def call_as_leaf(module: torch.nn.Module, *args: torch.fx.Proxy) -> torch.fx.Proxy:
    """Record ``module(*args)`` as one ``call_module`` node of the graph being traced and
    return its output ``Proxy``: what the tracer does for the modules it treats as leaves.

    Called from a forward that received a ``Proxy`` (:func:`is_traced`), so it works under
    any tracer (TorchRec's, ``torch.fx``'s, a pipeline's) without being listed among its
    leaf modules. Where the module is the root of the trace (``symbolic_trace(ec)``, as
    TorchRec's own tests do), the node calls it by :data:`ROOT_CALL_NAME`, the attribute
    under which the module answers itself (:attr:`DynamicModule.collection
    <dynemb.modules.dynamic_module.DynamicModule.collection>`): the ``GraphModule`` then holds the
    very same module as its child of that name.
    """
    tracer = args[0].tracer
    path = tracer.path_of_module(module) or ROOT_CALL_NAME
    return tracer.create_proxy("call_module", path, tuple(args), {})


def traced_outputs(out: torch.fx.Proxy, names: List[str]) -> Dict[str, torch.fx.Proxy]:
    """A sequence collection's traced output as TorchRec's ``EmbeddingCollection`` traces:
    a dict with one ``Proxy`` (of a ``JaggedTensor``) per output name, in output order, so
    that traced code may iterate it (``for name, jt in out.items()``) as eager code does.

    Example::

        >>> graph = torch.fx.Graph()
        >>> out = torch.fx.Proxy(graph.placeholder("out"))
        >>> list(traced_outputs(out, ["f", "g@t"]))
        ['f', 'g@t']
    """
    return {name: out[name] for name in names}


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
