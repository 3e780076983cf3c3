package metrics

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// describing records the name and variable labels of every metric
// registered with it, as Prometheus will expose them.
type describing struct{ names []string }

// descRE reads a Desc's String(): its fully-qualified name and its variable
// labels (the only accessor Desc has).
var descRE = regexp.MustCompile(`fqName: "([^"]+)".*variableLabels: \{([^}]*)\}`)

func (d *describing) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	for desc := range ch {
		m := descRE.FindStringSubmatch(desc.String())
		if m == nil {
			return &unreadableDesc{desc.String()}
		}
		d.names = append(d.names, m[1]+"{"+m[2]+"}")
	}
	return nil
}

func (d *describing) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := d.Register(c); err != nil {
			panic(err)
		}
	}
}

func (d *describing) Unregister(prometheus.Collector) bool { return false }

type unreadableDesc struct{ s string }

func (e *unreadableDesc) Error() string { return "unreadable metric description: " + e.s }

// TestTheMetricNamesAndLabelsAreTheContract enumerates every metric New
// registers, with its labels, and compares the list with
// testdata/names.txt, written from the broker before its core was split into
// packages (issue 29). The charts' alerts and the dashboard query these
// names: a rename or a changed label set must be a decision, made by
// editing that file, never a side effect.
func TestTheMetricNamesAndLabelsAreTheContract(t *testing.T) {
	var d describing
	_, err := New(&d)
	require.NoError(t, err)
	slices.Sort(d.names)
	got := strings.Join(d.names, "\n") + "\n"
	path := filepath.Join("testdata", "names.txt")
	if os.Getenv("UPDATE_METRIC_NAMES") == "1" {
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, string(want), got)
}
