//! CPU backend (rayon): the fallback and the oracle for the kernels.
