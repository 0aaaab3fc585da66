"""The GPU benchmarks at the sizes people serve (`python -m benchmarks.gpu.at_size`), each
figure beside its hardware limit measured in the same run; on the CPU they run as small
stand-ins, which is how CI tries them."""
