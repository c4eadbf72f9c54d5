"""Pure domain logic of the sandbox service: errors, auth, quotas, sessions, request rules."""
