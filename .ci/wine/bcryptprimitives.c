/* Wine 8 has no bcryptprimitives.dll; Rust's std imports ProcessPrng from
 * it for its random numbers (HashMap seeds). Windows 10+ has the DLL; this
 * stand-in, placed beside python.exe under Wine only, fills the buffer from
 * BCryptGenRandom, which Wine does have. */
#include <windows.h>
#include <bcrypt.h>

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len)
{
    while (len > 0) {
        ULONG n = len > 0x40000000 ? 0x40000000 : (ULONG)len;
        if (BCryptGenRandom(NULL, data, n, BCRYPT_USE_SYSTEM_PREFERRED_RNG) != 0)
            return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}
