"""Test support: installs the CPU stand-ins for SGLang's quantized linear methods in every process.

Python imports `sitecustomize` at start-up from PYTHONPATH, so SGLang's scheduler and detokenizer
subprocesses get the patch too. See cpu_quant.py for what is replaced and why.
"""

import cpu_quant

cpu_quant.install()
