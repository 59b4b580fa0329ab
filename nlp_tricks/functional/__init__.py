"""The tricks' math in plain torch: losses, attacks, SAM, SMART, CRF, pooling, multi-sample dropout, averaging, layers,
NEFTune and scheduled sampling. No ``Trainer`` or ``TrainerCallback`` here: every function and module works in a
hand-written training loop; :mod:`nlp_tricks.tricks` wires them into :class:`~nlp_tricks.TricksTrainer`."""
