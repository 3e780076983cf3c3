package issuers

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

func TestARefReadsTheParsedLeafAsItWouldTheCertificatePEM(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)

	fromPEM := Credential{CertificatePEM: kp.CertPEM}.Ref()
	fromLeaf := Credential{CertificatePEM: kp.CertPEM, Leaf: kp.Cert}.Ref()
	require.Equal(t, fromPEM, fromLeaf)
	require.Equal(t, "certificate_serial", fromLeaf.LogKey)
	require.Equal(t, kp.Cert.SerialNumber.Text(16), fromLeaf.Value)
	require.Regexp(t, `^X509SHA256=[0-9a-f]{64}$`, fromLeaf.APIID)

	require.Equal(t, Ref{LogKey: "certificate_serial"}, Credential{CertificatePEM: []byte("not PEM")}.Ref(),
		"a certificate that does not parse is named by nothing")
}

func TestARefNamesATokenByItsJTI(t *testing.T) {
	t.Parallel()
	// {"alg":"none"}.{"jti":"jti-42"}.sig
	ref := Credential{Token: "eyJhbGciOiJub25lIn0.eyJqdGkiOiJqdGktNDIifQ.c2ln"}.Ref()
	require.Equal(t, Ref{LogKey: "token_jti", Value: "jti-42", APIID: "JTI=jti-42"}, ref)
	require.Equal(t, Ref{LogKey: "token_jti"}, Credential{Token: "opaque"}.Ref())
}
