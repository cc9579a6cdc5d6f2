"""The data model: masks, caches, configuration, validation, device and JIT binding."""
