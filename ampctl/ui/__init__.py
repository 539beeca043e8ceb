"""Display: the live table, plain lines, and the TensorBoard sink."""
