# SPDX-License-Identifier: Apache-2.0
"""Test and example helpers: PyTorch Llamas in the Hugging Face and vLLM layouts
(weightbus.testing.llama). Needs torch."""
