package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/server"
)

func TestDevGatewayURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, addr, want, err string
	}{
		{name: "a loopback address is the URL as is", addr: "127.0.0.1:8445", want: "https://127.0.0.1:8445"},
		{name: "an unspecified host is reached on loopback", addr: ":8445", want: "https://127.0.0.1:8445"},
		{name: "0.0.0.0 is reached on loopback", addr: "0.0.0.0:18445", want: "https://127.0.0.1:18445"},
		{name: "an IPv6 address keeps its brackets", addr: "[::1]:8445", want: "https://[::1]:8445"},
		{name: "a host name is kept", addr: "localhost:8445", want: "https://localhost:8445"},
		{name: "port 0 is refused, since the URL is needed before the listener", addr: "127.0.0.1:0", err: "needs a port"},
		{name: "a named port is refused", addr: "127.0.0.1:https", err: "needs a port"},
		{name: "an address without a port is refused", addr: "127.0.0.1", err: "--gateway-address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := devGatewayURL(tc.addr)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestDevBannerPrintsGatewayLinesOnlyWithAGateway(t *testing.T) {
	t.Parallel()
	files := server.DevFiles{CACert: "/d/ca.crt", ClientCert: "/d/west.crt", ClientKey: "/d/west.key"}
	commands := func(gateway string) []string {
		var out bytes.Buffer
		printDevCommands(&out, devBanner{dir: "/d", files: files, api: "127.0.0.1:8443", ops: "127.0.0.1:9090", gateway: gateway, kubectl: "kubectl"})
		var cmds []string
		for _, l := range strings.Split(out.String(), "\n") {
			if strings.HasPrefix(l, "  ") {
				cmds = append(cmds, strings.TrimSpace(l))
			}
		}
		return cmds
	}

	without := commands("")
	require.Len(t, without, 5)
	require.NotContains(t, strings.Join(without, "\n"), "gateway")

	with := commands("https://127.0.0.1:8445")
	require.Len(t, with, 8, "the direct lines, a gateway kubeconfig, a watch through it, its revocation, then the rest")
	require.Contains(t, with[2], `"access":"gateway"`)
	require.Contains(t, with[2], "-o /d/gateway.kubeconfig -D /d/gateway.headers")
	require.Equal(t, "kubectl --kubeconfig /d/gateway.kubeconfig get configmaps -w", with[3])
	require.Contains(t, with[4], "-X DELETE https://127.0.0.1:8443/v1/leases/$(grep -i '^x-lease-id:' /d/gateway.headers")
	require.Equal(t, without, append(with[:2:2], with[5:]...), "the other lines are as without a gateway")
}
