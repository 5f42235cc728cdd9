"""The ``transformers`` model class of the ``boost`` layout. These two modules are copied
into every exported folder and import nothing but ``torch`` and ``transformers``."""
