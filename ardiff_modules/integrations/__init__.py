"""Optional integrations with other libraries' models.

Nothing is imported here: each integration is its own module and imports its third-party
package only when used, e.g. :mod:`ardiff_modules.integrations.diffusers` (extra ``[diffusers]``).
"""
