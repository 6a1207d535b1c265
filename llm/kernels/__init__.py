"""The native CPU kernels: one C source built per instruction set, loaded with ctypes."""
