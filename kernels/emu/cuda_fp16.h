// The CPU emulator defines these types in emu.h.
#pragma once
#include "emu.h"
