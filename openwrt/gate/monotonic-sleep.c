/*
 * Preloaded before libfaketime by the procd gate's python3 wrapper.
 *
 * The gate fakes only the realtime clock (FAKETIME_DONT_FAKE_MONOTONIC=1): a
 * router whose clock is not set yet.  libfaketime 0.9.10 then fails every
 * clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...) with EINVAL, which is
 * how Python's time.sleep() sleeps.  A monotonic clock that is not faked needs
 * no translation: this hands those sleeps straight to the kernel and every
 * other clock to the next definition (libfaketime's).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clk, int flags, const struct timespec *req, struct timespec *rem)
{
	static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);

	if (clk == CLOCK_MONOTONIC || clk == CLOCK_BOOTTIME) {
		if (syscall(SYS_clock_nanosleep, clk, flags, req, rem) == -1)
			return errno;
		return 0;
	}
	if (!next)
		next = (int (*)(clockid_t, int, const struct timespec *, struct timespec *))
			dlsym(RTLD_NEXT, "clock_nanosleep");
	return next(clk, flags, req, rem);
}
