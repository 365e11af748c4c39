"""The demo model's training (train_demo.py), its corpus reader (rdata.py) and
a check of the engine against transformers (check_engine.py); a package so
the measuring scripts beside it can read the corpus split the same way."""
