"""The CPU demo: a synthetic arithmetic task, a Qwen2-style tokenizer and a warm-started tiny Qwen2.

Prepare it with ``qurl-prepare-demo`` (see ``qurl.demo.prepare``).
"""
