"""Sampling: what a step's logits become: the next token (`sampler.py`), its log-probabilities
(`logprobs.py`), whether a request is done (`stopping.py`), grammar masks for constrained prompts
(`structured_output.py`) and scored choices (`choice_scoring.py`)."""
