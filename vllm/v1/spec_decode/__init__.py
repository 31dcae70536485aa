"""Speculative decoding: draft proposers and acceptance statistics (torch-free here).

The rejection sampler, which needs torch, lives in `vllm/v1/sample/rejection_sampler.py`.
"""
