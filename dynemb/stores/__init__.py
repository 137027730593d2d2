"""Where CACHE tables keep the rows their device tier evicts: host memory, or local disk
(RocksDB) with a host level in front."""
