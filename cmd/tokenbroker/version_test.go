package main

import (
	"bytes"
	"encoding/json"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestVersionReportsTheBuildFromTheVCSSettings(t *testing.T) {
	t.Parallel()
	bi := &debug.BuildInfo{
		GoVersion: "go1.26.8",
		Main:      debug.Module{Version: "(devel)"},
		Settings: []debug.BuildSetting{
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "d88e077c0ffee"},
			{Key: "vcs.time", Value: "2026-11-20T09:30:00Z"},
			{Key: "vcs.modified", Value: "true"},
		},
	}
	b := buildInfoFrom("v0.3.0", bi, true)
	require.Equal(t, "v0.3.0", b.Version)
	require.Equal(t, "d88e077c0ffee", b.Revision)
	require.True(t, b.Dirty)
	require.Equal(t, time.Date(2026, 11, 20, 9, 30, 0, 0, time.UTC), *b.CommitTime)
	require.Equal(t, "go1.26.8", b.GoVersion)
	require.Equal(t, runtime.GOOS+"/"+runtime.GOARCH, b.Platform)

	var out bytes.Buffer
	require.NoError(t, printVersion(&out, b, "text"))
	require.Equal(t, "tokenbroker v0.3.0\n"+
		"  revision:    d88e077c0ffee (dirty: uncommitted changes)\n"+
		"  commit time: 2026-11-20T09:30:00Z\n"+
		"  go:          go1.26.8\n"+
		"  platform:    "+runtime.GOOS+"/"+runtime.GOARCH+"\n", out.String())

	out.Reset()
	require.NoError(t, printVersion(&out, b, "json"))
	var got map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &got))
	require.Equal(t, map[string]any{
		"version": "v0.3.0", "revision": "d88e077c0ffee", "commitTime": "2026-11-20T09:30:00Z", "dirty": true,
		"goVersion": "go1.26.8", "platform": runtime.GOOS + "/" + runtime.GOARCH,
	}, got)
}

func TestVersionWithoutVCSInformationSaysSo(t *testing.T) {
	t.Parallel()
	b := buildInfoFrom("dev", &debug.BuildInfo{Main: debug.Module{Version: "v0.4.1"}}, true)
	require.Equal(t, "v0.4.1", b.Version, "go install ...@v0.4.1 names the version")
	var out bytes.Buffer
	require.NoError(t, printVersion(&out, b, ""))
	require.Contains(t, out.String(), "revision:    unknown (built without VCS information)")

	b = buildInfoFrom("dev", nil, false)
	require.Equal(t, "dev", b.Version)
	require.Equal(t, runtime.Version(), b.GoVersion)
	require.Error(t, printVersion(&out, b, "yaml"))
}

func TestVersionCommandFirstLineNamesTheVersion(t *testing.T) {
	t.Parallel()
	root := newRootCommand()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"version"})
	require.NoError(t, root.Execute())
	first, _, _ := strings.Cut(out.String(), "\n")
	require.Equal(t, "tokenbroker "+currentBuild().Version, first)
}
