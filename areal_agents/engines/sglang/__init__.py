"""The SGLang side: `SGLangEngine` (the client of SGLang's native HTTP API) and that API's JSON shapes."""
