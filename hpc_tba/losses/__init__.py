"""Training objectives as pure functions of tensors."""
