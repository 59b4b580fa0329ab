"""The tricks' math in plain torch (no ``Trainer`` import): span heads for named-entity recognition so far."""
