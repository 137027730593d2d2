"""TorchRec's prefetch train pipeline, made to run on devices without streams (CPU).

``torchrec.distributed.train_pipeline.PrefetchTrainPipelineSparseDist`` prefetches only when
it has a data-dist stream, so on CPU it never calls ``prefetch`` and its forward then fails
(``Invalid PrefetchPipelinedForward usage``). This subclass keeps TorchRec's schedule and, when
there is no stream, calls each pipelined module's ``prefetch`` inline at the same point of the
step. On CUDA it is TorchRec's pipeline unchanged.

Relies on TorchRec's private step ``_prefetch(context)`` (overridden), the pipeline's
``_data_dist_stream``, ``_pipelined_modules``, ``_device`` and ``_stream_context``, and
``torchrec.distributed.train_pipeline.utils._prefetch_embeddings``: the pipeline has no public
hook for where its prefetch runs. Public as
:class:`dynemb.pipelines.PrefetchTrainPipelineSparseDist`.
"""
from __future__ import annotations

from torchrec.distributed.train_pipeline import train_pipelines
from torchrec.distributed.train_pipeline.utils import _prefetch_embeddings


class PrefetchTrainPipelineSparseDist(train_pipelines.PrefetchTrainPipelineSparseDist):
    """``PrefetchTrainPipelineSparseDist`` that also prefetches on CPU.

    Example::

        >>> pipeline = PrefetchTrainPipelineSparseDist(  # doctest: +SKIP
        ...     model, optimizer, torch.device("cpu"))
        >>> for _ in range(steps):  # doctest: +SKIP
        ...     loss, out = pipeline.progress(batches)
    """

    def _prefetch(self, context) -> None:
        if self._data_dist_stream is not None:
            super()._prefetch(context)
            return
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        data = _prefetch_embeddings(None, context, self._pipelined_modules, self._device,
                                    self._stream_context, None, None)
        for name, dist_input in data.items():
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = context.module_contexts.pop(name)
