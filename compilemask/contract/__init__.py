"""Layer 0, the contract: the ExecutionDescriptor every engine reads, the kernel
options, the environment, the compile caches and the log. Imports nothing of the
project but its own modules (options reads the descriptor)."""
