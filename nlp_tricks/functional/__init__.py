"""The tricks' math in plain torch: losses, attacks, SAM, SMART, CRF, span scores (GlobalPointer), pooling,
multi-sample dropout, averaging, layers, NEFTune, scheduled sampling and encoder-decoder tying. No ``Trainer`` or
``TrainerCallback`` here: every function and module works in a hand-written training loop; :mod:`nlp_tricks.tricks`
wires them into :class:`~nlp_tricks.TricksTrainer`."""
