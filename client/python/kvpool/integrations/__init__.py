# SPDX-License-Identifier: Apache-2.0
"""Optional integrations of kvpool with other libraries, each in its own module and imported only
on request: `import kvpool` never imports them (nor torch, nor transformers).

    kvpool.integrations.transformers   a Hugging Face transformers Cache backed by kvpool, its
                                       "kvpool" attention function, and kvpool_generate()
                                       (prefix reuse through the daemon). Needs torch and
                                       transformers: pip install 'kvpool[transformers]'.
"""
