"""The demo: a tiny random-weight model builder (with its tokenizers and chat templates) and the sample
dataset."""
