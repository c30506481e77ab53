from tessera import _native
