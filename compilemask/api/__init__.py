"""Layer 6, the public API: ``attention`` and its engine choice, serving, context
parallelism, warmup, the picture and the command line. Imports every layer below."""
