"""Key/value stores with torch.distributed's API: the rendezvous of a job.

* :class:`Store`: the abstract base (torch's method set and semantics).
* :class:`HashStore`: in one process, thread-safe.
* :class:`FileStore`: in a file, shared by the processes of one machine.
* :class:`PrefixStore`: a view of another store under ``f"{prefix}/"``.
* :class:`TCPStore`: across machines, on JAX's coordination service.
"""

from jaxpg.stores.file_store import FileStore
from jaxpg.stores.hash_store import HashStore
from jaxpg.stores.prefix_store import PrefixStore
from jaxpg.stores.store import DEFAULT_TIMEOUT, Store
from jaxpg.stores.tcp_store import TCPStore

__all__ = ["DEFAULT_TIMEOUT", "FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]
