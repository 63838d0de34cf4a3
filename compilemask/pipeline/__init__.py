"""Layer 4, compile and preprocess: ``compile_mask`` (``CompiledMask``), the preprocess
pipeline that turns a batch's metadata into an ExecutionDescriptor, per-head groups and
the text renderings. Imports contract, dsl, compiler and codegen."""
