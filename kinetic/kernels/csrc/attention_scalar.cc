// The reference path of the attention kernel: attention_impl.h with one lane, plain C++.
#define KN_ATTN_W 1
#define KN_ATTN_UNIT attention_unit_scalar
#include "attention_impl.h"
