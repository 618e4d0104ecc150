"""The forward manager and what it needs: request values, validation, the context registry.

- :mod:`~ardiff_modules.forwards.manager`: :class:`ForwardManager` -- prepare (validated request ->
  reservation -> layouts -> plan -> begin the context), finish, re-cache, through one build path;
- :mod:`~ardiff_modules.forwards.request`: ``Build``, the validated request (:class:`ForwardOptions`,
  what a caller asks, is the session's);
- :mod:`~ardiff_modules.forwards.validation`: a request's checks, before any change;
- :mod:`~ardiff_modules.forwards.registry`: the reused forward contexts, LRU-bounded;
- :mod:`~ardiff_modules.forwards.commit_checks`: the ``check_finite`` device check.
"""

from ardiff_modules.forwards.manager import ForwardManager
from ardiff_modules.session import ForwardOptions

__all__ = ["ForwardManager", "ForwardOptions"]
