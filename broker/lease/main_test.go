package lease

import (
	"os"
	"testing"
)

// TestMain turns off client-go's streaming lists (WatchListClient, on by
// default since client-go 0.35) for this package's tests: the fake metadata
// client cannot serve them, and a reflector that asks a fake for one waits
// forever for its closing bookmark (see broker's TestMain).
func TestMain(m *testing.M) {
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", "false"); err != nil {
		panic(err)
	}
	os.Exit(m.Run())
}
