# PYTHON_ARGCOMPLETE_OK
"""`python -m rackctl`: the same CLI as the `rackctl` script.

The marker above (within the file's first 1024 bytes) is what argcomplete's global completion
(`activate-global-python-argcomplete`) looks for before it completes `python -m rackctl ...`;
`rackctl completion bash|zsh` binds the checkout's own interpreter (`.venv/bin/python`) without it.
"""

from rackctl.main import main

if __name__ == "__main__":
    main()
