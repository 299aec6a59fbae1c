"""`agentkv cache analyze`: offline hit rates per capacity x block size x eviction policy."""
