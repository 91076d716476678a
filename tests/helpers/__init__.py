"""Builders the tests share, one module per kind of thing built: LoRA adapters (`adapters`), the
hf engine's test settings (`hf_engine`), the engines' log-prob check (`logprob_check`), lakes
written like rounds (`lakes`, `synthetic_lake`), the learner's hand-computable batch
(`learner_batch`), the ratings' reference loop (`reference_ratings`) and headless Chromium
(`browser`). Tests import from here, never from another test module."""
