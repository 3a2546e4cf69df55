"""The streaming HF <-> Megatron converters: ``convert.hf_to_mcore.hf_to_mcore`` and
``convert.mcore_to_hf.mcore_to_hf``. Not re-exported here: the functions share their modules' names, and a
package attribute ``hf_to_mcore`` that is a function would shadow the module for ``import ... as``."""
