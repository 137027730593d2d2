"""Whether the ``load_state_dict`` a module's ``_load_from_state_dict`` runs under is strict.

``nn.Module.load_state_dict(sd, strict=False)`` passes ``strict=True`` down to every
module's ``_load_from_state_dict`` whatever it was given (it applies ``strict`` itself, at
the end, to the missing and unexpected keys it collected), and
``DistributedModelParallel.load_state_dict`` hands a sharded module to that same method.
Parameters do not need to know; a dynamic module does: its tables load all together or not
at all, so it must decide before the end whether a table absent from the state dict
stops the others (strict) or is only reported as missing (not strict). This module reads
the ``strict`` the user gave to the innermost ``nn.Module.load_state_dict`` running.
"""
from __future__ import annotations

import inspect

import torch

_LOAD_STATE_DICT = torch.nn.Module.load_state_dict.__code__


def load_is_strict(passed: bool) -> bool:
    """The ``strict`` of the load under way: ``passed`` (what ``_load_from_state_dict``
    received) when it is False (a caller that passes it on, as DMP's own loader does), else
    the ``strict`` argument of the innermost ``nn.Module.load_state_dict`` call on the
    stack; True when none is running (a direct ``_load_from_state_dict`` call).

    Example::

        >>> class Probe(torch.nn.Module):
        ...     def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
        ...                               missing_keys, unexpected_keys, error_msgs):
        ...         self.seen = (strict, load_is_strict(strict))
        >>> probe = Probe()
        >>> _ = probe.load_state_dict({}, strict=False)
        >>> probe.seen
        (True, False)
        >>> _ = probe.load_state_dict({})
        >>> probe.seen
        (True, True)
    """
    if not passed:
        return False
    frame = inspect.currentframe().f_back
    while frame is not None:
        if frame.f_code is _LOAD_STATE_DICT:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return True
