"""Code that runs inside the sandbox: the zygote, the jail set-up and the request workers.

Standard library only (plus Debian's ``seccomp`` module in the zygote): these files are copied into
the sandbox's read-only staging directory and run by the system Python, never by the project venv.
``protocol`` is also imported by the service side of the channel.
"""
